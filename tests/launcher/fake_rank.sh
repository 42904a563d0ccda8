#!/usr/bin/env bash
# A stand-in trainer for run.sh's launcher test: prints its rank's environment; the rank named by
# FAIL_RANK exits with status 3 after a moment, the others would run for a minute.
echo "rank $RANK of $WORLD_SIZE (local $LOCAL_RANK of $LOCAL_WORLD_SIZE) master $MASTER_ADDR:$MASTER_PORT args: $*"
if [[ $RANK == "${FAIL_RANK:-none}" ]]; then sleep 0.5; exit 3; fi
exec sleep "${RUN_SECONDS:-60}"  # exec: SIGTERM reaches the sleep itself
