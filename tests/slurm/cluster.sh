#!/usr/bin/env bash
# A one-node SLURM cluster on 127.0.0.1 for tests and CI, from Debian's packages.
#
#   tests/slurm/cluster.sh start [DIR]   install if missing, start, wait for the node to be idle;
#                                        prints the SLURM_CONF path (DIR/slurm.conf) on stdout
#   tests/slurm/cluster.sh stop DIR      cancel its jobs, stop its daemons by pid file
#   tests/slurm/cluster.sh status DIR    which daemons run, and sinfo
#   tests/slurm/cluster.sh restart-ctld DIR   restart slurmctld alone (state kept); its periodic
#                                        30 s checks (time limits, their --signal) restart with it
#
# Everything lives under DIR (default: a new /tmp/slurm-ci.XXXXXX): config, state, logs, pid files,
# and a private munged with its own key and socket, so two clusters on one machine do not collide
# (free ports are picked at start). Facts behind the settings: ../../../shared/notes/slurm-ci.md
# (one node named localhost, cgroup/v1, cred_expire=5, tight scheduler intervals).
#
# Exit codes: 0 ok; 1 failed to start (logs are printed); 2 usage; 3 SLURM is not installed and
# cannot be installed here (not root, no apt-get, or apt-get failed): the tests skip on 3 only.
set -Eeuo pipefail

EXIT_UNAVAILABLE=3
IDLE_TIMEOUT_S=${SLURM_CI_IDLE_TIMEOUT_S:-60}
STOP_TIMEOUT_S=10
# SIGTERM to SIGKILL when ci-urgent preempts a ci job: room for the ranks to checkpoint under load.
GRACE_TIME_S=${SLURM_CI_GRACE_TIME_S:-60}
PACKAGES=(slurmctld slurmd slurm-client munge)
COMMANDS=(slurmctld slurmd sbatch srun scontrol squeue sinfo scancel munged mungekey munge)
PYTHON=${PYTHON:-python3}

log() { printf 'cluster.sh: %s\n' "$*" >&2; }

missing_commands() {
  local c
  for c in "${COMMANDS[@]}"; do
    command -v "$c" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$c" >/dev/null 2>&1 || printf '%s ' "$c"
  done
}

ensure_installed() {
  export PATH="$PATH:/usr/sbin:/sbin"
  local missing
  missing=$(missing_commands)
  [ -z "$missing" ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    log "unavailable: SLURM commands missing ($missing) and not root, so apt-get cannot install them"
    exit "$EXIT_UNAVAILABLE"
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    log "unavailable: SLURM commands missing ($missing) and no apt-get on this machine"
    exit "$EXIT_UNAVAILABLE"
  fi
  log "installing ${PACKAGES[*]} (missing: $missing)"
  local out
  out=$(mktemp)
  if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
    --no-install-recommends "${PACKAGES[@]}"; } >"$out" 2>&1; then
    tail -n 20 "$out" >&2
    rm -f "$out"
    log "unavailable: apt-get could not install ${PACKAGES[*]} (output above)"
    exit "$EXIT_UNAVAILABLE"
  fi
  rm -f "$out"
}

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

write_config() {
  local dir=$1 ctld_port slurmd_port
  ctld_port=$(free_port)
  slurmd_port=$(free_port)
  while [ "$slurmd_port" = "$ctld_port" ]; do slurmd_port=$(free_port); done
  mkdir -p "$dir/state" "$dir/spool"
  cat >"$dir/slurm.conf" <<EOF
# Written by tests/slurm/cluster.sh: one node on 127.0.0.1, everything under $dir.
ClusterName=ci
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5,socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=5
OverTimeLimit=0
MinJobAge=600
InactiveLimit=0
MailProg=/bin/true
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
# Preemption as preemptible clusters run it: a job in ci-urgent (higher tier) preempts ci's jobs,
# which SLURM requeues itself after sending them SIGTERM and a grace time (docs/slurm.md).
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=ci Nodes=localhost Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE_TIME_S
PartitionName=ci-urgent Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF
  # slurmd 22.05 always loads a cgroup plugin; cgroup/v1's init touches nothing with the plugins above,
  # while autodetection fails on read-only or hybrid cgroup layouts.
  printf 'CgroupPlugin=cgroup/v1\n' >"$dir/cgroup.conf"
}

start_munged() {
  local dir=$1
  # munged wants every directory above its socket searchable by all, and a key owned by its user.
  chmod 755 "$dir"
  mkdir -p "$dir/munge"
  chmod 755 "$dir/munge"
  [ -f "$dir/munge/munge.key" ] || mungekey --create --keyfile="$dir/munge/munge.key"
  munged --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/munged.seed" \
    </dev/null >>"$dir/daemons.out" 2>&1
  munge -S "$dir/munge/munge.socket" -n | unmunge -S "$dir/munge/munge.socket" >/dev/null
}

print_logs() {
  local dir=$1 f
  for f in munged.log slurmctld.log slurmd.log daemons.out; do
    [ -f "$dir/$f" ] && { log "--- tail of $dir/$f"; tail -n 15 "$dir/$f" >&2; }
  done
  return 0
}

wait_idle() {
  local dir=$1 deadline state=""
  deadline=$((SECONDS + IDLE_TIMEOUT_S))
  while [ "$SECONDS" -lt "$deadline" ]; do
    state=$(SLURM_CONF="$dir/slurm.conf" sinfo -h -n localhost -o %T 2>/dev/null || true)
    [ "$state" = "idle" ] && return 0
    sleep 0.2
  done
  log "node not idle after ${IDLE_TIMEOUT_S}s (state: '${state:-none}')"
  return 1
}

cmd_start() {
  local dir=${1:-}
  ensure_installed
  if [ -z "$dir" ]; then
    dir=$(mktemp -d /tmp/slurm-ci.XXXXXX)
  else
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
  fi
  # Any failure from here on stops whatever was started, then reports.
  trap 'rc=$?; log "start failed (exit $rc)"; print_logs "$dir"; cmd_stop "$dir"; exit 1' ERR
  write_config "$dir"
  start_munged "$dir"
  slurmctld -c -f "$dir/slurm.conf" </dev/null >>"$dir/daemons.out" 2>&1
  slurmd -N localhost -f "$dir/slurm.conf" </dev/null >>"$dir/daemons.out" 2>&1
  wait_idle "$dir"
  trap - ERR
  log "up: node localhost idle, $(nproc) CPUs; export SLURM_CONF=$dir/slurm.conf"
  printf '%s\n' "$dir/slurm.conf"
}

pid_of() {
  local f=$1 pid
  [ -f "$f" ] || return 1
  pid=$(cat "$f" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && printf '%s' "$pid"
}

stop_pid() {
  local name=$1 pid=$2 deadline
  kill -TERM "$pid" 2>/dev/null || return 0
  deadline=$((SECONDS + STOP_TIMEOUT_S))
  while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    log "$name (pid $pid) ignored SIGTERM for ${STOP_TIMEOUT_S}s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
}

ancestors() {
  local pid=$$
  while [ "$pid" -gt 1 ]; do
    printf '%s ' "$pid"
    pid=$(awk '{print $4}' "/proc/$pid/stat" 2>/dev/null) || return 0
  done
}

# Job processes outlive slurmd (slurmstepd is reparented); each carries SLURM_JOB_ID and this
# cluster's SLURM_CONF in its environment. Never this script or whoever called it.
job_pids() {
  local conf=$1 env_file pid skip
  skip=" $(ancestors) "
  for env_file in /proc/[0-9]*/environ; do
    pid=${env_file#/proc/}
    pid=${pid%/environ}
    [[ "$skip" == *" $pid "* || "$pid" == "$BASHPID" ]] && continue
    if grep -qzxF "SLURM_CONF=$conf" "$env_file" 2>/dev/null &&
      grep -qz '^SLURM_JOB_ID=' "$env_file" 2>/dev/null; then
      printf '%s\n' "$pid"
    fi
  done
}

cmd_stop() {
  local dir=${1:?usage: cluster.sh stop DIR} pid name deadline
  dir=${dir%/slurm.conf}
  local conf="$dir/slurm.conf"
  if [ -n "$(pid_of "$dir/slurmctld.pid" || true)" ]; then
    SLURM_CONF="$conf" scancel --full --quiet --partition=ci 2>/dev/null || true
    deadline=$((SECONDS + STOP_TIMEOUT_S))
    while [ -n "$(SLURM_CONF="$conf" squeue -h -t R,CG -o %i 2>/dev/null || true)" ] &&
      [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
  fi
  for name in slurmd slurmctld munged; do
    pid=$(pid_of "$dir/$name.pid" || true)
    [ -n "$pid" ] && stop_pid "$name" "$pid"
  done
  for pid in $(job_pids "$conf"); do
    log "killing leftover job process $pid"
    kill -KILL "$pid" 2>/dev/null || true
  done
  log "stopped (files kept in $dir)"
}

cmd_restart_ctld() {
  local dir=${1:?usage: cluster.sh restart-ctld DIR} pid
  dir=${dir%/slurm.conf}
  pid=$(pid_of "$dir/slurmctld.pid" || true)
  [ -n "$pid" ] && stop_pid slurmctld "$pid"
  slurmctld -f "$dir/slurm.conf" </dev/null >>"$dir/daemons.out" 2>&1
  wait_idle "$dir" || { print_logs "$dir"; exit 1; }
}

cmd_status() {
  local dir=${1:?usage: cluster.sh status DIR} name pid rc=0
  dir=${dir%/slurm.conf}
  for name in munged slurmctld slurmd; do
    if pid=$(pid_of "$dir/$name.pid"); then
      printf '%s: running (pid %s)\n' "$name" "$pid"
    else
      printf '%s: not running\n' "$name"
      rc=1
    fi
  done
  SLURM_CONF="$dir/slurm.conf" sinfo 2>&1 || rc=1
  return "$rc"
}

case "${1:-}" in
  start) cmd_start "${2:-}" ;;
  stop) cmd_stop "${2:-}" ;;
  status) cmd_status "${2:-}" ;;
  restart-ctld) cmd_restart_ctld "${2:-}" ;;
  *)
    echo "usage: $0 start [DIR] | stop DIR | status DIR | restart-ctld DIR" >&2
    exit 2
    ;;
esac
