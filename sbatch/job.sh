#!/bin/bash
# Resumable distributed training on SLURM: one watchdog per node, each running torchrun; the job
# requeues itself after a preemption or time-limit checkpoint. Details: docs/slurm.md.
#
#   sbatch sbatch/job.sh [TRAINER ARGS...]
#   PYTHON=.venv/bin/python sbatch --nodes=4 --time=2-00:00:00 sbatch/job.sh -m train_ref.train --steps 100000
#
# The #SBATCH lines below are defaults: edit them, or override any on the sbatch command line.
# Knobs (environment variables; sbatch hands your environment to the job):
#   RUN_DIR          checkpoint root, on a filesystem every node sees
#                    default: $SLURM_SUBMIT_DIR/runs/$SLURM_JOB_NAME, or in an array task
#                    $SLURM_SUBMIT_DIR/runs/${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}
#   PYTHON           a python with this project and torch installed        default: python3
#   TRAIN_ARGS       the trainer command when the script gets no arguments, split into words like a
#                    shell would (never evaluated)                         default: -m train_ref.train
#   CKPT_FLAG        appended with RUN_DIR to the trainer's arguments; '' appends nothing
#                                                                          default: --ckpt-root
#   NPROC_PER_NODE   ranks per node                default: $SLURM_GPUS_ON_NODE if set, else 1
#   NNODES           torchrun --nnodes: N, or MIN:MAX for an elastic run
#                                              default: $SLURM_JOB_NUM_NODES - $SPARE_NODES
#   RDZV_HOST        c10d rendezvous host              default: the first host of the allocation
#   RDZV_PORT        c10d rendezvous port              default: 20000 + (job id mod 10000)
#   TORCHRUN_OPTS    more torchrun options (e.g. --local-addr=...; never --max-restarts > 0: the
#                    watchdog owns restarts, `slurm start` refuses it)    default: none
#   WATCH_OPTS       more watchdog options (python -m supervisor watch --help)        default: none
#                    --standby on more than one node: a roster (as with SPARE_NODES) keeps every
#                    node's next launch started and releases them together
#   MAX_PREEMPT_REQUEUES  requeues after a preemption or time-limit checkpoint (exit 13)  default: 100
#   MAX_REQUEUES     requeues after a failure (storage unavailable, exit 14)          default: 10
#                    both counted in RUN_DIR/supervisor/slurm.json (shown by `supervisor status`),
#                    or by SLURM when that cannot be read
#   NOTICE_REPEAT_S  repeat a notice to the nodes every N s until they are done      default: 30
#   REQUEUE_SIGNAL   the notice's signal: USR1 or URG (NCCL builds have caught USR1); the
#                    #SBATCH --signal line below cannot follow it: edit it to match, or pass
#                    --signal=B:URG@120 (or SBATCH_SIGNAL=B:URG@120) to sbatch   default: USR1
#   STOP_GRACE_S     when SLURM sends SIGTERM to the step (PreemptMode=REQUEUE), seconds each
#                    watchdog gives its ranks to checkpoint before SIGKILL; torchrun gives them
#                    30 s (fixed in torch), and the partition's GraceTime must cover it   default: 30
#   SPARE_NODES      hot spares: of the allocation's nodes, this many wait (imports done) to take
#                    a lost node's place inside the allocation; submit with --nodes=N+SPARE_NODES
#                    and --no-kill (else SLURM ends the job when it marks the node down)  default: 0
#   NODE_TIMEOUT_S   a node whose watchdog's summary stays silent this long is lost        default: 30
#   BAD_NODE_INCIDENTS  failures pinned on a host that make it a bad node: left out of the next
#                    launch when a spare can take its place, excluded from a requeue     default: 2
#   BAD_NODE_ACTION  exclude (scontrol update JobId=... ExcNodeList=) or drain (exclude, and
#                    scontrol update NodeName=... State=DRAIN; needs an operator's rights) default: exclude
#   STRAGGLER_ACTION report (events, status) or bad-node (each straggler verdict is also an
#                    incident of its host)                                                default: report
#
# Preemption and time limit: SLURM sends REQUEUE_SIGNAL to this shell (--signal=B:USR1@SECONDS
# before the limit; keep B:, change the seconds to cover one checkpoint; or scancel --signal=USR1
# --batch JOBID). The trap only notes it; the loop forwards it to the watchdogs, which tell the
# ranks; they checkpoint at the next step boundary and exit 75; the watchdogs exit 13; this script
# then runs `scontrol requeue` once (while MAX_PREEMPT_REQUEUES lasts) and exits. Storage that stayed
# unavailable past the watchdog's retries (exit 14: committed checkpoints intact) requeues the same
# way, against MAX_REQUEUES instead. A finished run (0) and a non-retryable failure (12) end the
# job without a requeue. On several nodes `slurm coordinate` runs beside srun: it finds lost nodes,
# pins failures on hosts (RUN_DIR/supervisor/bad_nodes.json) and, with SPARE_NODES (or --standby in
# WATCH_OPTS), writes the roster (who trains, who waits) and says when the job is over (srun waits for
# a lost node's task).
#
#SBATCH --job-name=resumable
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
##SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
set -uo pipefail

# An array's tasks each get their own run dir (and requeue their own ARRAYID_TASKID).
job_ref=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}
: "${RUN_DIR:=${SLURM_SUBMIT_DIR:-$PWD}/runs/${job_ref:-${SLURM_JOB_NAME:-resumable}}}"
job_ref=${job_ref:-${SLURM_JOB_ID:-}}
: "${PYTHON:=python3}"
: "${TRAIN_ARGS=-m train_ref.train}"
: "${CKPT_FLAG=--ckpt-root}"
: "${NPROC_PER_NODE:=${SLURM_GPUS_ON_NODE:-1}}"
: "${SPARE_NODES:=0}"
case "$SPARE_NODES" in '' | *[!0-9]*)
  echo "job.sh: SPARE_NODES='$SPARE_NODES': set a whole number of nodes" >&2
  exit 2
  ;;
esac
: "${NNODES:=$((${SLURM_JOB_NUM_NODES:-1} - SPARE_NODES))}"
: "${RDZV_HOST:=}" "${RDZV_PORT:=}" "${TORCHRUN_OPTS:=}" "${WATCH_OPTS:=}"
: "${MAX_PREEMPT_REQUEUES:=100}" "${MAX_REQUEUES:=10}"
: "${NOTICE_REPEAT_S:=30}"
: "${REQUEUE_SIGNAL:=USR1}"
: "${STOP_GRACE_S:=30}"
: "${NODE_TIMEOUT_S:=30}" "${BAD_NODE_INCIDENTS:=2}"
: "${BAD_NODE_ACTION:=exclude}" "${STRAGGLER_ACTION:=report}"
REQUEUE_SIGNAL=${REQUEUE_SIGNAL^^}
REQUEUE_SIGNAL=${REQUEUE_SIGNAL#SIG}
export RUN_DIR PYTHON TRAIN_ARGS CKPT_FLAG NPROC_PER_NODE NNODES RDZV_HOST RDZV_PORT TORCHRUN_OPTS \
  WATCH_OPTS MAX_PREEMPT_REQUEUES MAX_REQUEUES REQUEUE_SIGNAL STOP_GRACE_S SPARE_NODES NODE_TIMEOUT_S \
  BAD_NODE_INCIDENTS BAD_NODE_ACTION STRAGGLER_ACTION

case "$NOTICE_REPEAT_S" in '' | *[!0-9]*)
  echo "job.sh: NOTICE_REPEAT_S='$NOTICE_REPEAT_S': set a whole number of seconds" >&2
  exit 2
  ;;
esac
STEP_START_S=5

notice=0 notice_sig=$REQUEUE_SIGNAL
# Keep them short: the loop below forwards the notice. `slurm start` says which signals may be used.
# SIGTERM here (scancel --signal=TERM --batch, a cancel, the end of a preemption's GraceTime) is a
# notice too: the ranks checkpoint if they get the time; `slurm finish` asks SLURM whether to requeue.
trap 'notice=1 notice_sig=TERM' TERM
if ! trap 'notice=1 notice_sig=$REQUEUE_SIGNAL' "$REQUEUE_SIGNAL" 2>/dev/null; then
  echo "job.sh: REQUEUE_SIGNAL='$REQUEUE_SIGNAL' is not a signal name; use USR1 or URG" >&2
  exit 2
fi

"$PYTHON" -m supervisor slurm start --job-script "$0" -- "$@" || exit $?

# A roster drives the launches with spares, and with --standby in WATCH_OPTS on more than one node
# (each node's standby released together): supervisor.slurm.env.Knobs.rostered decides, 1 or 0.
if ! ROSTER=$("$PYTHON" -m supervisor slurm rostered -- "$@"); then
  echo "$ROSTER"
  exit 2
fi
# Under a roster a lost node's task must not end the step (srun --no-kill; the job's --no-kill keeps
# the allocation when SLURM marks the node down).
spare_opts=()
[ "$ROSTER" = 1 ] && spare_opts=(--no-kill)
srun --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" --kill-on-bad-exit=0 "${spare_opts[@]}" \
  "$PYTHON" -m supervisor slurm launch -- "$@" &
srun_pid=$!
coord_pid=
if [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]; then
  "$PYTHON" -m supervisor slurm coordinate -- "$@" &
  coord_pid=$!
fi
# Under a roster the coordinator says when the job is over: srun may wait for a lost node's task
# until SLURM marks that node down.
coordinator_done() {
  [ "$ROSTER" = 1 ] && [ -n "$coord_pid" ] && ! kill -0 "$coord_pid" 2>/dev/null
}
# srun forwards USR1 (and USR2) to the step but drops URG, so URG goes to the steps through
# slurmctld: scancel without --batch signals every process of the job's steps, not this shell.
notify_step() {
  if [ "$REQUEUE_SIGNAL" = USR1 ]; then
    kill -s USR1 "$srun_pid" 2>/dev/null
  else
    scancel --quiet --signal="$REQUEUE_SIGNAL" "$job_ref"
  fi
}

told=0
next_forward=$((SECONDS + STEP_START_S)) # until the step's python ignores the notice's signal
while kill -0 "$srun_pid" 2>/dev/null; do
  sleep 1 &
  wait $! # a notice interrupts this wait at once
  if [ "$notice" = 1 ] && [ "$SECONDS" -ge "$next_forward" ]; then
    # srun hands the signal to every process of the step; a rank still starting up ignores it, so
    # repeat it until the step ends.
    if [ "$told" = 0 ]; then
      echo "[job.sh $(date -u +%FT%TZ)] SIG$notice_sig (preemption or time limit): telling the watchdogs to checkpoint with SIG$REQUEUE_SIGNAL"
      told=1
    fi
    notify_step
    next_forward=$((SECONDS + NOTICE_REPEAT_S))
  fi
  coordinator_done && break
done
if coordinator_done; then
  wait "$coord_pid"
  rc=$?
  kill -KILL "$srun_pid" 2>/dev/null # it waits for a lost node's task: every live node is done
  wait "$srun_pid" 2>/dev/null
else
  wait "$srun_pid"
  rc=$?
  if [ -n "$coord_pid" ]; then
    # Under a roster the coordinator's code counts (a lost node's task reports no exit of its own):
    # it ends within a tick of the last watchdog's final summary. Without, it judges its last
    # evidence and goes.
    if [ "$ROSTER" = 1 ]; then
      deadline=$((SECONDS + ${NODE_TIMEOUT_S%.*} + 5))
      while kill -0 "$coord_pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
    fi
    if kill -0 "$coord_pid" 2>/dev/null; then
      kill -TERM "$coord_pid" 2>/dev/null
      wait "$coord_pid" 2>/dev/null
    else
      wait "$coord_pid"
      coord_rc=$?
      [ "$ROSTER" = 1 ] && rc=$coord_rc
    fi
  fi
fi

"$PYTHON" -m supervisor slurm finish --exit-code "$rc" -- "$@"
exit $?
