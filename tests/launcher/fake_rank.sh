#!/usr/bin/env bash
# A stand-in trainer for run.sh's launcher test: prints its rank's environment (torchrun's variables,
# and Slurm's task and task count, which the trainer reads when torchrun's are unset) and pid; the rank
# named by FAIL_RANK says why and exits with status 3 after a moment, the one named by KILL_RANK is
# killed by SIGKILL, the one named by IGNORE_TERM_RANK ignores SIGTERM; the others would run for a
# minute.
echo "rank $RANK of $WORLD_SIZE (local $LOCAL_RANK of $LOCAL_WORLD_SIZE) master $MASTER_ADDR:$MASTER_PORT" \
  "slurm task ${SLURM_PROCID-none} of ${SLURM_NTASKS-none} pid $$ args: $*"
if [[ $RANK == "${FAIL_RANK:-none}" ]]; then sleep 0.5; echo "error: rank $RANK's stand-in failure"; exit 3; fi
if [[ $RANK == "${KILL_RANK:-none}" ]]; then sleep 0.5; kill -KILL $$; fi
if [[ $RANK == "${IGNORE_TERM_RANK:-none}" ]]; then trap '' TERM; fi  # inherited by the exec'd sleep
exec sleep "${RUN_SECONDS:-60}"  # exec: SIGTERM reaches the sleep itself
