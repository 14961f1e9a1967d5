#!/bin/sh
# hora's batch script. It is the same for every job: no user value is written into it. Its
# arguments start the rank launcher; everything else is an sbatch option.
HORA_MASTER_HOST=$(hostname)
export HORA_MASTER_HOST
step=
trap '[ -n "$step" ] && kill -USR2 "$step" 2>/dev/null' USR2
trap '[ -n "$step" ] && kill -TERM "$step" 2>/dev/null' TERM
"$HORA_SRUN" --distribution=block --kill-on-bad-exit=0 "$@" &
step=$!
while :; do
  wait "$step"
  rc=$?
  kill -0 "$step" 2>/dev/null || break
done
exit "$rc"
