#!/bin/bash
# Submits the parts as a job array and the index as a job that starts once every part succeeded.
# Prints the two job ids. Options are passed to the array's sbatch: submit-array.sh --array=0-63%16
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

parts=$(sbatch --parsable "$@" "$here/reshard-array.sbatch")
parts=${parts%%;*}                             # "id;cluster" on a multi-cluster site
# afterok: only if every array task completed; a failed or cancelled part cancels the index job.
index=$(sbatch --parsable --dependency=afterok:"$parts" --kill-on-invalid-dep=yes "$here/reshard-index.sbatch")
echo "$parts"
echo "${index%%;*}"
