#!/usr/bin/env bash
# A SLURM cluster on one machine for tests and CI, from Debian's packages: one node on 127.0.0.1,
# or N real slurmd nodes, each in its own network and UTS namespace.
#
#   tests/slurm/cluster.sh start [--nodes N] [DIR]   install if missing, start, wait for every node
#                                        to be idle; prints the SLURM_CONF path (DIR/slurm.conf)
#   tests/slurm/cluster.sh stop DIR      cancel its jobs, stop its daemons by pid file, and with
#                                        --nodes N > 1 delete its links, namespaces and hosts files
#   tests/slurm/cluster.sh status DIR    which daemons run, and sinfo
#   tests/slurm/cluster.sh restart-ctld DIR   restart slurmctld alone (state kept); its periodic
#                                        30 s checks (time limits, their --signal) restart with it
#   tests/slurm/cluster.sh kill-node DIR NODE   (--nodes N > 1) the node lost: SIGKILL to every
#                                        process in its network namespace, its slurmd included
#   tests/slurm/cluster.sh start-node DIR NODE  its slurmd started again, the node resumed and idle
#
# Everything lives under DIR (default: a new /tmp/slurm-ci.XXXXXX): config, state, logs, pid files,
# and a private munged with its own key and socket, so two clusters on one machine do not collide
# (free ports are picked at start). Facts behind the settings: ../../../shared/notes/slurm-ci.md
# (one node named localhost, cgroup/v1, cred_expire=5, tight scheduler intervals).
#
# --nodes N > 1: nodes n1..nN. Each slurmd runs under `ip netns exec` in its own network namespace
# (a veth pair into a bridge in the root namespace, addresses in 198.18.0.0/15, the block reserved
# for tests: the bridge is .1 and slurmctld's address, node i is .(i+1)) and `unshare --uts` with
# its own host name, so heartbeats tell the nodes apart. Node names resolve inside every node's
# namespace through /etc/netns/NETNS/hosts (`ip netns exec` binds it over /etc/hosts there; the
# machine's own /etc/hosts is not touched); slurmctld reaches the nodes by NodeAddr. The munge
# socket and the run directories are shared through the filesystem, and the process ids too (no
# PID namespace), so tests signal a node's processes from outside.
#
# Exit codes: 0 ok; 1 failed to start (logs are printed); 2 usage; 3 SLURM is not installed and
# cannot be installed here (not root, no apt-get, or apt-get failed), or, with --nodes N > 1, the
# machine cannot make network namespaces (no `ip`/`unshare`, or not permitted): the tests skip on 3.
set -Eeuo pipefail

EXIT_UNAVAILABLE=3
IDLE_TIMEOUT_S=${SLURM_CI_IDLE_TIMEOUT_S:-60}
STOP_TIMEOUT_S=10
# SIGTERM to SIGKILL when ci-urgent preempts a ci job: room for the ranks to checkpoint under load.
GRACE_TIME_S=${SLURM_CI_GRACE_TIME_S:-60}
# How long slurmctld waits for a silent slurmd before it marks the node DOWN (SLURM's default 300):
# the tests that lose a node set less, so the job's end does not wait minutes for it.
SLURMD_TIMEOUT_S=${SLURM_CI_SLURMD_TIMEOUT_S:-300}
PACKAGES=(slurmctld slurmd slurm-client munge)
COMMANDS=(slurmctld slurmd sbatch srun scontrol squeue sinfo scancel munged mungekey munge)
PYTHON=${PYTHON:-python3}

log() { printf 'cluster.sh: %s\n' "$*" >&2; }

usage() {
  echo "usage: $0 start [--nodes N] [DIR] | stop DIR | status DIR | restart-ctld DIR | kill-node DIR NODE | start-node DIR NODE" >&2
  exit 2
}

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
  # One apt-get at a time among this project's installers (supervisor/drill/faultctl.py's
  # APT_INSTALL_LOCK: a test worker may be installing fuse3 right now), then look again.
  exec 9>"${TMPDIR:-/tmp}/resumable-training-apt.lock"
  flock 9
  missing=$(missing_commands)
  [ -z "$missing" ] && { exec 9>&-; return 0; }
  log "installing ${PACKAGES[*]} (missing: $missing)"
  local out
  out=$(mktemp)
  if ! { apt-get -o DPkg::Lock::Timeout=300 update -q && DEBIAN_FRONTEND=noninteractive apt-get \
    -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "${PACKAGES[@]}"; } >"$out" 2>&1; then
    tail -n 20 "$out" >&2
    rm -f "$out"
    log "unavailable: apt-get could not install ${PACKAGES[*]} (output above)"
    exit "$EXIT_UNAVAILABLE"
  fi
  rm -f "$out"
  exec 9>&-
}

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The slurm.conf lines naming the controller and the nodes: localhost, or n1..nN on the bridge.
node_lines() {
  local nodes=$1 net=$2 names i
  if [ "$nodes" = 1 ]; then
    printf 'SlurmctldHost=localhost(127.0.0.1)\nNodeName=localhost NodeAddr=127.0.0.1 CPUs=%s State=UNKNOWN\n' "$(nproc)"
    return
  fi
  printf 'SlurmctldHost=localhost(%s.1)\n' "$net"
  for i in $(seq 1 "$nodes"); do
    printf 'NodeName=n%s NodeAddr=%s.%s CPUs=%s State=UNKNOWN\n' "$i" "$net" $((i + 1)) "$(nproc)"
  done
}

node_names() {
  local nodes=$1
  if [ "$nodes" = 1 ]; then printf 'localhost'; else printf 'n[1-%s]' "$nodes"; fi
}

write_config() {
  local dir=$1 nodes=$2 net=${3:-} ctld_port slurmd_port first_job_id names
  names=$(node_names "$nodes")
  ctld_port=$(free_port)
  slurmd_port=$(free_port)
  while [ "$slurmd_port" = "$ctld_port" ]; do slurmd_port=$(free_port); done
  # Job ids start in a window of 25 picked by the (free, so unique while it lives) controller
  # port: two test clusters on one machine then give their jobs different ids, hence different
  # default rendezvous ports (20000 + id mod 10000), instead of both starting at 1.
  first_job_id=$(( (ctld_port % 400) * 25 + 1 ))
  mkdir -p "$dir/state" "$dir/spool"
  cat >"$dir/slurm.conf" <<EOF
# Written by tests/slurm/cluster.sh: nodes $names, everything under $dir.
ClusterName=ci
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
FirstJobId=$first_job_id
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5,socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.%n.log
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
SlurmdTimeout=$SLURMD_TIMEOUT_S
OverTimeLimit=0
MinJobAge=600
InactiveLimit=0
MailProg=/bin/true
$(node_lines "$nodes" "$net")
# Preemption as preemptible clusters run it: a job in ci-urgent (higher tier) preempts ci's jobs,
# which SLURM requeues itself after sending them SIGTERM and a grace time (docs/slurm.md).
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=ci Nodes=$names Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE_TIME_S
PartitionName=ci-urgent Nodes=$names MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF
  # slurmd 22.05 always loads a cgroup plugin; cgroup/v1's init touches nothing with the plugins above,
  # while autodetection fails on read-only or hybrid cgroup layouts.
  printf 'CgroupPlugin=cgroup/v1\n' >"$dir/cgroup.conf"
  printf '%s\n' "$nodes" >"$dir/nodes"
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
  for f in "$dir/munged.log" "$dir/slurmctld.log" "$dir"/slurmd.*.log "$dir/daemons.out"; do
    [ -f "$f" ] && { log "--- tail of $f"; tail -n 15 "$f" >&2; }
  done
  return 0
}

nodes_of() {
  local dir=$1
  cat "$dir/nodes" 2>/dev/null || printf '1'
}

wait_idle() {
  local dir=$1 nodes deadline idle=0
  nodes=$(nodes_of "$dir")
  deadline=$((SECONDS + IDLE_TIMEOUT_S))
  while [ "$SECONDS" -lt "$deadline" ]; do
    idle=$(SLURM_CONF="$dir/slurm.conf" sinfo -h -N -p ci -o %T 2>/dev/null | grep -cx idle || true)
    [ "$idle" = "$nodes" ] && return 0
    sleep 0.2
  done
  log "$idle of $nodes node(s) idle after ${IDLE_TIMEOUT_S}s"
  SLURM_CONF="$dir/slurm.conf" sinfo -N >&2 || true
  return 1
}

# ---------------------------------------------------------------- namespaces for --nodes N > 1

# What was created, one "KIND NAME" a line (bridge, link, netns), written before each is made so
# that stop removes whatever a failed start left.
NET_FILE=net

netns_of() { printf 'slurm-ci-%s-n%s' "$1" "$2"; }

unavailable_net() {
  log "unavailable: $* (two slurmd nodes need network and UTS namespaces, as root)"
  exit "$EXIT_UNAVAILABLE"
}

# A /24 of 198.18.0.0/15 (reserved for tests) that no interface here uses yet; the search starts
# at a random one, so two clusters starting at the same moment rarely pick the same.
free_net() {
  local i k used start=$((RANDOM % 254))
  used=$(ip -o -4 addr show 2>/dev/null || true)
  for i in $(seq 0 253); do
    k=$(((start + i) % 254 + 1))
    [[ "$used" == *" 198.18.$k."* ]] || { printf '198.18.%s' "$k"; return 0; }
  done
  return 1
}

# Bridge BR (.1, slurmctld's address) in the root namespace; node i in netns NS_i, its veth end
# ci0 at .(i+1); /etc/netns/NS_i/hosts maps n1..nN inside every node.
make_network() {
  local dir=$1 nodes=$2 net=$3 id=$4 br=sci$4 i ns hosts
  command -v ip >/dev/null 2>&1 || unavailable_net "the ip command (iproute2) is missing"
  command -v unshare >/dev/null 2>&1 || unavailable_net "the unshare command (util-linux) is missing"
  [ "$(id -u)" -eq 0 ] || unavailable_net "not root"
  : >"$dir/$NET_FILE"
  printf 'netns %s\n' "$(netns_of "$id" 1)" >>"$dir/$NET_FILE"
  ip netns add "$(netns_of "$id" 1)" 2>"$dir/netns.err" ||
    unavailable_net "ip netns add failed: $(tail -n 1 "$dir/netns.err")"
  hosts=$(cat /etc/hosts)
  for i in $(seq 1 "$nodes"); do hosts+=$'\n'"$net.$((i + 1)) n$i"; done
  printf 'bridge %s\n' "$br" >>"$dir/$NET_FILE"
  ip link add "$br" type bridge
  ip addr add "$net.1/24" dev "$br"
  ip link set "$br" up
  for i in $(seq 1 "$nodes"); do
    ns=$(netns_of "$id" "$i")
    [ "$i" = 1 ] || { printf 'netns %s\n' "$ns" >>"$dir/$NET_FILE" && ip netns add "$ns"; }
    mkdir -p "/etc/netns/$ns"
    printf '%s\n' "$hosts" >"/etc/netns/$ns/hosts"
    printf 'link %s\n' "$br$i" >>"$dir/$NET_FILE"
    ip link add "$br$i" type veth peer name ci0 netns "$ns"
    ip link set "$br$i" master "$br"
    ip link set "$br$i" up
    ip -n "$ns" addr add "$net.$((i + 1))/24" dev ci0
    ip -n "$ns" link set ci0 up
    ip -n "$ns" link set lo up
  done
}

# Links first (a veth's root end can outlive its namespace), then namespaces, then the bridge.
remove_network() {
  local dir=$1 kind name
  [ -f "$dir/$NET_FILE" ] || return 0
  for kind in link netns bridge; do
    while read -r k name; do
      [ "$k" = "$kind" ] || continue
      case "$kind" in
        link | bridge) ip link del "$name" 2>/dev/null || true ;;
        netns)
          ip netns del "$name" 2>/dev/null || true
          rm -rf "/etc/netns/${name:?}"
          ;;
      esac
    done <"$dir/$NET_FILE"
  done
  rmdir /etc/netns 2>/dev/null || true
  rm -f "$dir/$NET_FILE"
  log "removed the nodes' links, namespaces and hosts files"
}

start_slurmds() {
  local dir=$1 nodes=$2 id=${3:-} i
  if [ "$nodes" = 1 ]; then
    slurmd -N localhost -f "$dir/slurm.conf" </dev/null >>"$dir/daemons.out" 2>&1
    return
  fi
  for i in $(seq 1 "$nodes"); do
    # shellcheck disable=SC2016  # $1 and $2 are the inner shell's arguments
    ip netns exec "$(netns_of "$id" "$i")" unshare --uts sh -c 'hostname "$1" && exec slurmd -N "$1" -f "$2"' \
      sh "n$i" "$dir/slurm.conf" </dev/null >>"$dir/daemons.out" 2>&1
  done
}

cmd_start() {
  local dir="" nodes=1 net="" id=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --nodes) nodes=${2:-}; shift 2 || usage ;;
      --nodes=*) nodes=${1#--nodes=}; shift ;;
      -*) usage ;;
      *) dir=$1; shift ;;
    esac
  done
  [[ "$nodes" =~ ^[1-9]$ ]] || { log "--nodes '$nodes': use 1 to 9"; exit 2; }
  ensure_installed
  if [ -z "$dir" ]; then
    dir=$(mktemp -d /tmp/slurm-ci.XXXXXX)
  else
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
  fi
  # Any failure from here on stops whatever was started, then reports.
  trap 'rc=$?; log "start failed (exit $rc)"; print_logs "$dir"; cmd_stop "$dir"; exit 1' ERR
  if [ "$nodes" -gt 1 ]; then
    id=$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')
    net=$(free_net) || unavailable_net "no free /24 left in 198.18.0.0/16"
    trap 'rc=$?; [ "$rc" = "$EXIT_UNAVAILABLE" ] && remove_network "$dir"; exit "$rc"' EXIT
    make_network "$dir" "$nodes" "$net" "$id"
    trap - EXIT
  fi
  write_config "$dir" "$nodes" "$net"
  start_munged "$dir"
  slurmctld -c -f "$dir/slurm.conf" </dev/null >>"$dir/daemons.out" 2>&1
  start_slurmds "$dir" "$nodes" "$id"
  wait_idle "$dir"
  trap - ERR
  log "up: $(node_names "$nodes") idle, $(nproc) CPUs each; export SLURM_CONF=$dir/slurm.conf"
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
  for name in "$dir"/slurmd.*.pid "$dir/slurmctld.pid" "$dir/munged.pid"; do
    pid=$(pid_of "$name" || true)
    name=${name##*/}
    [ -n "$pid" ] && stop_pid "${name%.pid}" "$pid"
  done
  for pid in $(job_pids "$conf"); do
    log "killing leftover job process $pid"
    kill -KILL "$pid" 2>/dev/null || true
  done
  remove_network "$dir"
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

# The network namespace of node NAME of the cluster in DIR (from its net file).
node_netns() {
  local dir=$1 name=$2 kind ns
  while read -r kind ns; do
    [ "$kind" = netns ] && [ "${ns##*-}" = "$name" ] && { printf '%s' "$ns"; return 0; }
  done <"$dir/$NET_FILE"
  log "no node $name in $dir (a cluster started with --nodes N > 1?)"
  exit 2
}

cmd_kill_node() {
  local dir=${1:?usage: cluster.sh kill-node DIR NODE} name=${2:?usage: cluster.sh kill-node DIR NODE} ns pids
  dir=${dir%/slurm.conf}
  ns=$(node_netns "$dir" "$name")
  pids=$(ip netns pids "$ns" | tr '\n' ' ')
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
  log "node $name lost: SIGKILL to every process of $ns (${pids:-none})"
}

cmd_start_node() {
  local dir=${1:?usage: cluster.sh start-node DIR NODE} name=${2:?usage: cluster.sh start-node DIR NODE} ns
  dir=${dir%/slurm.conf}
  ns=$(node_netns "$dir" "$name")
  # shellcheck disable=SC2016  # $1 and $2 are the inner shell's arguments
  ip netns exec "$ns" unshare --uts sh -c 'hostname "$1" && exec slurmd -N "$1" -f "$2"' \
    sh "$name" "$dir/slurm.conf" </dev/null >>"$dir/daemons.out" 2>&1
  SLURM_CONF="$dir/slurm.conf" scontrol update NodeName="$name" State=RESUME 2>/dev/null || true
  wait_idle "$dir" || { print_logs "$dir"; exit 1; }
}

cmd_status() {
  local dir=${1:?usage: cluster.sh status DIR} name pid rc=0
  dir=${dir%/slurm.conf}
  for name in "$dir/munged.pid" "$dir/slurmctld.pid" "$dir"/slurmd.*.pid; do
    if pid=$(pid_of "$name"); then
      printf '%s: running (pid %s)\n' "$(basename "$name" .pid)" "$pid"
    else
      printf '%s: not running\n' "$(basename "$name" .pid)"
      rc=1
    fi
  done
  SLURM_CONF="$dir/slurm.conf" sinfo 2>&1 || rc=1
  return "$rc"
}

case "${1:-}" in
  start) shift && cmd_start "$@" ;;
  stop) cmd_stop "${2:-}" ;;
  status) cmd_status "${2:-}" ;;
  restart-ctld) cmd_restart_ctld "${2:-}" ;;
  kill-node) cmd_kill_node "${2:-}" "${3:-}" ;;
  start-node) cmd_start_node "${2:-}" "${3:-}" ;;
  *) usage ;;
esac
