#!/bin/bash
# One part, numbered by the launcher that started it; `reshard-part.sh index` once at the end.
#   torchrun --nnodes=8 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=HOST:29400 \
#            --no_python ./reshard-part.sh
#   mpirun -n 8 --map-by ppr:1:node ./reshard-part.sh       # Open MPI
#   mpiexec -n 8 -ppn 1 ./reshard-part.sh                   # MPICH
#   srun --ntasks-per-node=1 ./reshard-part.sh              # Slurm
set -euo pipefail

IN=${IN:-/lustre/ckpt/global_step1000}         # DeepSpeed ZeRO-3, 256 ranks
OUT=${OUT:-/lustre/ckpt/step1000-dcp64}        # DCP, 64 ranks
LAYOUT=${LAYOUT:---to dcp --world-size 64}     # the same options for every part and the index
THREADS=${THREADS:-$(nproc)}

if [ "${1:-}" = index ]; then
  exec statedict convert "$IN" "$OUT" $LAYOUT --part index
elif [ -n "${RANK:-}" ] && [ -n "${WORLD_SIZE:-}" ]; then
  part=$RANK/$WORLD_SIZE                                  # torchrun
elif [ -n "${OMPI_COMM_WORLD_RANK:-}" ]; then
  part=$OMPI_COMM_WORLD_RANK/$OMPI_COMM_WORLD_SIZE        # Open MPI
elif [ -n "${PMI_RANK:-}" ]; then
  part=$PMI_RANK/$PMI_SIZE                                # MPICH (Hydra)
elif [ -n "${SLURM_PROCID:-}" ]; then
  part=$SLURM_PROCID/$SLURM_NTASKS                        # srun
else
  echo "reshard-part.sh: no launcher rank in the environment (RANK and WORLD_SIZE, OMPI_COMM_WORLD_RANK," \
       "PMI_RANK or SLURM_PROCID): start it with torchrun, mpirun, mpiexec or srun" >&2
  exit 2
fi
exec statedict convert "$IN" "$OUT" $LAYOUT --part "$part" --threads "$THREADS" --memory-budget 1GiB
