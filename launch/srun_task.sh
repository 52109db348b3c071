#!/bin/bash
# One srun task of launch/pretrain.sbatch:  srun_task.sh LAUNCHER PYTHON SCRIPT ARGS...
#   srun:     this task is one rank (megafp8 reads SLURM_PROCID, SLURM_STEP_NUM_TASKS,
#             SLURM_LOCALID); exec replaces the shell, so Slurm's signals reach Python directly.
#   torchrun: this task is one node; torchrun starts NPROC_PER_NODE workers on it.
set -euo pipefail
launcher=$1 python=$2
shift 2
case "$launcher" in
srun)
    exec "$python" "$@"
    ;;
torchrun)
    # torchrun's agent dies on USR1 unless it handles it; handling it means forwarding it to
    # the workers (which then save and exit) before shutting them down.
    export TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
    exec "$python" -m torch.distributed.run --nnodes="$SLURM_JOB_NUM_NODES" \
        --node-rank="$SLURM_NODEID" --nproc-per-node="${NPROC_PER_NODE:-1}" \
        --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" "$@"
    ;;
*)
    echo "error: LAUNCHER=$launcher: must be srun or torchrun" >&2
    exit 2
    ;;
esac
